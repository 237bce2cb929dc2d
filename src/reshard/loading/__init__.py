"""The load pipeline: manifest -> check against the target -> plan reads -> read
(reading) -> replica handover (handover).
"""
