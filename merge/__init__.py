"""Model merging.

- ``submerge.merge.strategies``: one pure function per method over one tensor's task vectors, and the
  registry ``STRATEGIES`` (options from the functions' signatures; mergekit spellings in ``ALIASES``);
- ``submerge.merge.rules``: ``ParameterRule`` (how one tensor is merged) and the functions that make rules;
- ``submerge.merge.plan``: ``diag plan`` (granularity and α per unit from a store) and ``Plan.rule_for``;
- ``submerge.merge.writer``: the pure ``merge_tensor`` and the streaming ``write_merge`` / ``ShardWriter``;
- ``submerge.merge.run``: ``run_merge``, the driver behind ``diag merge`` (data steps of closed-form and regmean).
"""
