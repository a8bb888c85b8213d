"""What the experiment scripts share: arguments, results and plots (common), datasets (NQ,
WikiText), windows and datastores with their cached branch scores (lm_datastore, which also
scores ahead from the command line), SQuAD and its merged datastore, the LSR studies' grids,
power and release, and the QA study's data and report."""
