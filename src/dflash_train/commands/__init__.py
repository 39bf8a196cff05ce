"""The commands that are not foundations of the package: export, prepare, demo, doctor, the resumable pipeline the
demo and the quality benchmark run in, and the configuration reference's writer. cli.py parses each command's
flags and calls the function here."""
