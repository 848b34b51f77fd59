"""Supervised fine-tuning of the models we serve (attnserve finetune / merge)."""
