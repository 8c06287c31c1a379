"""Helpers shared by the tests: ``distributed`` (a function on N gloo processes), ``launch`` (a script or the Hydra
app in a subprocess), ``replicas`` (replicas identical and close to a reference), ``runs`` (one launch per strategy
shared by a module's tests), ``netns`` (whether network namespaces can be made here)."""
