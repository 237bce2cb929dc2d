"""The save pipeline: snapshot -> plan -> write shard files -> publish manifest last
(save, over its phases: snapshot collects, persist writes), the attempt every
rank agrees on (attempt), the async stager (staging) and its handles (pending).
"""
