"""The fine-tuning demo's data (invented facts) and its client, `make finetune-demo`."""
