"""fusiond.models: the model zoo (GPT-2 family, HF GPT-2, ResNets, a non-chain DAG)."""
