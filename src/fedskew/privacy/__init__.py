"""User-level differential privacy for federated rounds (McMahan et al., ICLR 2018): each client's whole update
clipped on the client (:mod:`fedskew.privacy.mechanism`), Gaussian noise added once to the weighted sum on the server
with a fixed denominator, and the privacy loss of the rounds counted by an accountant
(:mod:`fedskew.privacy.accountant`, on Google's ``dp-accounting``: ``pip install 'fedskew[privacy]'``)."""
