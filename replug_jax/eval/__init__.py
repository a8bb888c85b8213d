"""Evaluation harnesses, one shape: an evaluator is built from its data and settings and
``run(pipe) -> dict`` evaluates a :class:`~replug_jax.replug.Replug` pipeline.

* :class:`replug_jax.eval.perplexity.LMEvaluator`: bits per byte / perplexity (Table 1, Figure 4);
* :class:`replug_jax.eval.qa.QAEvaluator`: gold-answer log-likelihood, EM, F1 (Table 3),
  resumable from a file of per-question records;
* :class:`replug_jax.eval.mmlu.MMLUEvaluator`: MMLU accuracy by category (Table 2);
* :class:`replug_jax.eval.gold_recall.RetrievalEvaluator`: recall@k of gold passages.
"""
