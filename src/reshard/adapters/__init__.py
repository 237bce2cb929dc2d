"""Adapters from the usual parts of a training state to the state tree."""
