"""The split placement, where target ranks compute hidden states and drafter ranks train on them: the schedule,
tickets and point-to-point messages between the two sides (`transport`), and the target rank that loads the target
and serves hidden states until the drafter ranks stop (`target_server`)."""
