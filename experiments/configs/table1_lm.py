"""Table 1 (language modelling, bits per byte) and Figure 4 (perplexity vs number of documents)
at laptop scale: WikiText-2 test articles, retrieval corpus = 128-token passages of WikiText-2
test under the leakage filter."""

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


CONFIGS = {
    "default": LMConfig(),
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
