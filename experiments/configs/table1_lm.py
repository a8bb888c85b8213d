"""Table 1 (language modelling, bits per byte) and Figure 4 (perplexity vs number of documents).

``default``: WikiText-103 test (all 60 articles, 256 windows, x = y = 128 tokens) against the
enwiki-sample datastore (221k passages of 100 words; ``experiments/lib/lm_datastore.py``), with the
WikiText test articles as the format-control datastore. ``wikitext2_datastore``: the earlier
setting, a small in-domain datastore (WikiText-2 test articles retrieving from the others)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class LMConfig:
    retriever: str = "minilm"  # paper: Contriever
    lm: str = "smollm2"  # paper: GPT-2 / GPT-3 / OPT / BLOOM
    lsr_retriever: str | None = None  # a trained retriever folder (the REPLUG LSR row)
    num_documents: int = 4  # evaluated articles: the first N of wiki.test.raw
    corpus_documents: int = 0  # articles chunked into the retrieval corpus (0 = all)
    passage_tokens: int = 128  # paper: 128-token documents
    context_tokens: int = 128  # LM input before each target window
    stride: int = 128  # target tokens per window = retrieval stride
    query_tokens: int = 128  # paper: the prior 128 tokens are the query
    skip_first: int = 128  # first tokens of an article: context only (nothing to query with)
    max_windows_per_document: int = 3
    leakage: str = "document"  # document (the evaluated article never retrieved) | window | none
    k: int = 10  # paper: top-10
    temperature: float = 1.0  # the retrieval temperature τ of λ = softmax(s/τ) (paper: 1)
    modes: tuple = ("none", "replug", "random", "concat")
    ks: tuple = (1, 2, 5, 10, 20)  # figure 4
    max_context: int = 1024
    batch_size: int = 2  # windows scored together (each with k branches)
    seed: int = 0
    # -- the real-datastore setting (experiments/lib/lm_datastore.py) --------------------------
    # "wikitext2": the evaluated text's own other articles (the earlier setting); otherwise an
    # index directory from `replug index build`, or enwiki:N (first N enwiki articles, in memory)
    datastore: str = "wikitext2"
    eval_text: str = "wikitext103"  # wikitext103 (test, tokenised) | wikitext2 (test, raw)
    windows: int = 256  # evaluated windows, taken in rounds over all articles
    control_datastore: str = ""  # format control: "wikitext103" (other test articles) or ""
    control_documents: int = 0  # articles chunked into the control datastore (0 = all)
    control_k: int = 0  # documents per window of the control (0 = k); compared at this k
    leak_ngram: int = 13  # a window leaks into a passage sharing a word n-gram with its target
    drop_leaking: bool = False  # exclude each window's leaking passages from its retrieval
    tau_grid: tuple = (0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0)  # τ fitted on folds
    tau_folds: int = 5  # article folds of the cross-fitted τ
    cache: str = ""  # the LM-score store and indexes (default runs/lm_datastore): resumable


# built by: replug index build --corpus <enwiki sample> --out runs/enwiki_idx (README)
ENWIKI_INDEX = "runs/enwiki_idx"
SMALL = LMConfig()  # the earlier setting: a small in-domain datastore (WikiText-2 test)

CONFIGS = {
    "default": LMConfig(datastore=ENWIKI_INDEX, control_datastore="wikitext103", control_k=4,
                        num_documents=0, max_context=2048, batch_size=2, ks=tuple(range(1, 11))),
    # the same with every passage sharing a 13-gram with the window's target removed
    "no_leak": LMConfig(datastore=ENWIKI_INDEX, control_datastore="wikitext103", control_k=4,
                        num_documents=0, max_context=2048, batch_size=2, drop_leaking=True,
                        ks=tuple(range(1, 11))),
    "tiny_enwiki": LMConfig(datastore="enwiki:13", control_datastore="wikitext103",
                            control_documents=3, control_k=1, num_documents=2, windows=4,
                            passage_tokens=32, context_tokens=32, stride=32, query_tokens=32,
                            skip_first=32, k=2, ks=(1, 2), max_context=512, tau_folds=2),
    "wikitext2_datastore": SMALL,
    "tiny": LMConfig(num_documents=1, corpus_documents=3, passage_tokens=32, context_tokens=32,
                     stride=32, query_tokens=32, skip_first=32, max_windows_per_document=2,
                     k=2, ks=(1, 2), max_context=512),
    # REPLUG vs REPLUG LSR with the language-modelling objective (paper Table 1): the retriever
    # of `replug train-lsr --config experiments/configs/lsr_wikitext.py --workdir
    # runs/lsr_wikitext`, exported with `replug export-retriever --workdir runs/lsr_wikitext
    # --out runs/lsr_wikitext_export` (not released: see checkpoints/README.md).
    "lsr": LMConfig(lsr_retriever="runs/lsr_wikitext_export", modes=("none", "replug")),
    # The paper's setting on an accelerator: all of WikiText-2 test, top-10, a 1B LM.
    "wikitext_gpu": LMConfig(retriever="facebook/contriever", lm="meta-llama/Llama-3.2-1B",
                             num_documents=10_000, max_windows_per_document=0, batch_size=16,
                             max_context=2048),
}
