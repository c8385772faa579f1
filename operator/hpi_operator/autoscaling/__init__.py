"""Autoscaling on KV-cache utilisation.

- decision.py: the builtin scaler's decision, a pure function of settings, load, history and time;
- scrape.py: which runtime pods to read and an async scrape of their /metrics;
- loop.py: one poll (scrape -> decide -> what to write), pure but for the scrape;
- handlers.py: the kopf index of runtime pods and the timer that polls;
- manifests.py: the HPA (mode hpa) or KEDA ScaledObject (mode keda) child, written and pruned with the
  other children (children.py).
"""
