"""What the notebooks teach: worked examples, the design review, generated docs."""
