"""Whole-model training passes' building blocks: route recording and replay, adapter fine-tuning."""
