"""Coding-agent configurators (imported as mtplxctl.agents): one module per agent, plus the safe merge.

See docs/agents.md for what each agent gets and where.
"""
