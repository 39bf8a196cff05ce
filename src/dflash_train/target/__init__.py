"""The frozen target: loading and capture, its FSDP2 and tensor-parallel shards, its Hugging Face class and config,
its provenance and fingerprints, its FP8 quantisation."""
