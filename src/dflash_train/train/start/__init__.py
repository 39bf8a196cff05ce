"""A rank from its admission to its first step, in order: may this command use its run directory at all
(`directory_admission`, the supervisor's check), the rank's checks that need no weights (`rank_checks`), the process
group, data and memory plan (`rank_setup`), the target's weights (`target_load`), the drafter, optimizer and resumed
state (`drafter_session`, which builds the loop's Session), and the warm-up that compiles everything the loop will
run (`warmup`)."""
