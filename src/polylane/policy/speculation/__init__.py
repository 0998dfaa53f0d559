"""Speculative decoding's rules, lossless by construction: the accept rules of a verify pass
(`accept`), draft tree shapes (`tree`), prompt lookup (`ngram`), the cost model of a round
(`cost`) and the controller that turns speculation on and off per model (`control`)."""
