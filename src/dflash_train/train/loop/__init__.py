"""The training loop and what runs inside it: one optimizer step (`step`), the loop from the first planned step to the
export (`train_loop`), validation on held-out batches (`validate`), the model FLOPs and MFU of a step (`flops`), and
the stop requests a rank honours: signals and the run's STOP file (`stop`)."""
