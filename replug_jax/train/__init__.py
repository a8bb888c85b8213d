"""REPLUG LSR (paper §4): LM-supervised retriever training."""
