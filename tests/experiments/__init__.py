"""Tests of the experiment scripts and experiments/lib/."""
