"""From a dataset file to packed training rows.

- engine.data.files: reading JSON, JSONL, CSV, Parquet and ``save_to_disk`` folders into normalised examples;
- engine.data.tokenize: chat templates and loss masks;
- engine.data.packing: best-fit packing of tokenized examples into rows, and collating them into batches;
- engine.data.prepare: a data config to train/eval split, packed rows and their seeded order;
- engine.data.model_inputs: what a packed batch gives the model (positions, attention boundaries).
"""
