"""What the notebooks teach: worked examples, the design review, the claims it corrected (checked
against vLLM 0.33.0), what ran end to end, generated docs."""
