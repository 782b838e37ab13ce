"""Research tools read from the model's checkpoint: the weights that TransformerLens's
``ActivationCache`` analysis reads (:mod:`vlens.analysis.weights`) and the logit lens
(:mod:`vlens.analysis.lens`)."""
