"""The on-disk formats reshard reads: its own (manifest, codec of plain values, shard
files, the committed manifest read back with its signature and the records beside
it) and PyTorch DCP's, presented as a manifest (dcp, dcp_metadata, dcp_values,
dcp_blob; the names users import are in reshard.formats).
"""
