"""What the tool keeps on disk: the names of its files and folders and what a folder holds (layout), what a folder
given on the command line is (paths), what a command may write over (outputs), the modes of what it writes
(permissions), and the one way a file or a folder is written or replaced so that no reader sees half of it (io)."""
