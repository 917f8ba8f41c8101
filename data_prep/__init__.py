"""Data preparation: DAPO-Math-17k and the evaluation sets into verl's RL parquet format.

* ``python data_prep/dapo.py --local_dir DIR``: ``DIR/train.parquet`` (see :mod:`data_prep.dapo`);
* ``python data_prep/eval_sets.py --local_dir DIR``: ``DIR/<set>.parquet`` (see :mod:`data_prep.eval_sets`);
* :mod:`data_prep.reward_fn`: the custom reward function for verl (``reward.custom_reward_function.*``).
"""
