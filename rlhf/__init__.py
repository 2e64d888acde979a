"""The plumbing every script shares (README, the file table): sampling, data, checkpoints, tracking, LoRA,
rewards, the sandbox, tools, torchrun and memory accounting. The algorithms live in the scripts at the root."""
