"""The adversarial suite: generated attention calls, each run in fresh processes, classified.

See :mod:`tests.adversarial.runner` for how one case runs and is classified,
:mod:`tests.adversarial.cases` for what is generated, and ``python -m tests.adversarial.run``
for the command line.
"""
