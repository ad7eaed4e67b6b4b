"""Building the embedded kimi-tiny verifier (`make verifier`): build_verifier trains its tokenizer
(verifier_tokenizer, with Kimi's chat template) and model and writes its folder and model card
(verifier_card) to model/verifier/kimi_tiny."""
