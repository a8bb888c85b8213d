"""REPLUG LSR with the language-modelling objective (paper §4, §5.2) on WikiText-2 articles
(prepare with ``python -m experiments.prepare.wikitext``): x = 128 tokens, y = the next 128,
corpus = 128-token passages of every article plus distractors (NQ passages, Python docs); an
example never retrieves a passage of its own article (``leakage="document"``: the datastore is
disjoint from the evaluated text, as in the paper; ``"window"`` hides only the overlapping
passages and lets an example retrieve its own following text).

What a run needs: Adam moves each parameter by at most about lr per step, so ``total_steps ×
learning_rate`` bounds the change (the first NQ run, 32 × 2e-5 = 6e-4, could not move much).
The laptop variant uses 1e-4 (a bound of 1.2e-3) and LM scoring dominates its time: each step
scores batch × k = 32 (example, passage) pairs of about 400 tokens on 2 CPU cores.
"""

# nested as LSRConfig's pieces (replug_jax.train.config); `--set data.leakage=window` etc.
_DATA = {"task": "lm", "train": "experiments/data/wikitext/train.jsonl",
         "dev": "experiments/data/wikitext/dev.jsonl",
         "corpus": "experiments/data/wikitext/corpus.jsonl", "chunk_size": 128,
         "chunk_unit": "tokens", "leakage": "document", "context_tokens": 128,
         "continuation_tokens": 128}
_MINILM = {"name": "minilm", "query_max_length": 128, "doc_max_length": 160}
_SMOLLM = {"name": "smollm2", "max_context": 512}

CONFIGS = {
    # 12 steps of batch 8 (96 examples seen once, about 40 minutes on 2 shared cores), no
    # refresh within the run; the top-4 of the initial index is scored up front in large
    # batches (supervision.prescore_pool).
    "default": {"retriever": _MINILM, "lm": _SMOLLM, "data": {**_DATA, "dev_examples": 16},
                "k": 4, "batch_size": 8, "total_steps": 12, "checkpoint_every": 4,
                "retrieval": {"refresh_every": 12}, "optim": {"learning_rate": 1e-4},
                "supervision": {"prescore_pool": 4}},
    # CI: seconds.
    "tiny": {"retriever": _MINILM, "lm": _SMOLLM,
             "data": {**_DATA, "dev_examples": 2, "context_tokens": 32,
                      "continuation_tokens": 16},
             "k": 2, "batch_size": 2, "total_steps": 2, "checkpoint_every": 1,
             "retrieval": {"refresh_every": 2, "refresh_mode": "sync"},
             "objective": {"lm_score": "mean"}},
    # The paper's setting on an accelerator: k = 20, batch 64, 25k steps, refresh every 3k.
    "gpu": {"retriever": {**_MINILM, "name": "facebook/contriever"},
            "lm": {"name": "meta-llama/Llama-3.2-1B", "max_context": 1024}, "data": _DATA},
}
