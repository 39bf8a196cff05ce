"""benchmarks/quality.py's parts (the command line and `main` stay there):

    settings   the reference run compared with, the data stage's defaults, the eval sets
    overlap    which eval prompts are training prompts
    inputs     the prepared training data (reused while unchanged) and the eval prompts
    children   a stage's child processes: one per GPU, the deadline, failures
    driver     the stages (data, prepare, train, eval) of one call over the work directory
    workers    the children's entry points: decode worker, replay corpus, replay of one drafter
    shards     prompts split over workers and their records merged back
    pooling    tau and verified tokens pooled over datasets and modes; replay against decoding
    report     summary.json and summary.md
"""
