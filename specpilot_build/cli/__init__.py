"""The command line: every verb's parser (main.py), the demo and the sweep that orchestrate stages, and the one
place errors become messages and exit codes. It may import every stage; no stage imports it."""
