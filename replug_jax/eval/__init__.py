"""Evaluation harnesses: QA (EM/F1), language modelling, MMLU."""
