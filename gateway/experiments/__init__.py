"""A/B experiments on live traffic: arms, samples, verdicts, shadow copies and their sharing."""
