"""Inference on top of the KV store: an OPT decoder run layer by layer, a transformers Cache."""
