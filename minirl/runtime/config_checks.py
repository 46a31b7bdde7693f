"""The checks of notebook 00's settings: a `TaskConfig` or `WarmStartConfig` that cannot work is refused
at once, naming the setting and the fix.

Hand-written (it teaches nothing about RL). A task with an empty operand range, answers too long for
the verifier or the tokenizer's context, or a split with nothing left to train on would otherwise fail
minutes later, or not at all. The config classes call these from `__post_init__`.
"""


def check_task_config(config, operators: dict, max_digits: int) -> None:
    """ValueError naming the first impossible setting of a `TaskConfig`.

    operators: the task's operator table (its keys are the allowed `ops`); max_digits: the verifier's
    longest readable answer.
    """
    if not config.ops or any(op not in operators for op in config.ops):
        raise ValueError(f"TaskConfig.ops={config.ops!r}: use one or more of {''.join(operators)!r}")
    if config.min_operand < 0:
        raise ValueError(f"TaskConfig.min_operand={config.min_operand}: operands must be >= 0 "
                         "(a leading minus sign would be ambiguous in the prompt)")
    if config.max_operand < config.min_operand:
        raise ValueError(f"TaskConfig: empty operand range min_operand={config.min_operand} > "
                         f"max_operand={config.max_operand}; set max_operand >= min_operand")
    if config.max_answer_length > max_digits:
        raise ValueError(f"TaskConfig.max_operand={config.max_operand}: answers of {config.max_answer_length} "
                         f"digits exceed the verifier's MAX_DIGITS={max_digits}; lower max_operand")
    if config.sequence_length > config.max_length:
        raise ValueError(
            f"TaskConfig.max_operand={config.max_operand}: its longest prompt + answer + EOS "
            f"is {config.sequence_length} tokens, beyond the tokenizer's context "
            f"max_length={config.max_length}; lower max_operand or raise max_length")
    if not 0 < config.num_test < config.num_problems:
        raise ValueError(f"TaskConfig.num_test={config.num_test}: must be in 1..{config.num_problems - 1} "
                         f"(there are {config.num_problems} problems)")
    if not 0 <= config.num_validation < config.num_problems - config.num_test:
        raise ValueError(f"TaskConfig.num_validation={config.num_validation}: must be in 0.."
                         f"{config.num_problems - config.num_test - 1} (there are {config.num_problems} problems, "
                         f"{config.num_test} held out, and training needs at least one)")


def check_warm_start_config(config) -> None:
    """ValueError naming the impossible setting of a `WarmStartConfig`."""
    if config.steps < 0 or config.eval_every < 1 or config.batch_size < 1:
        raise ValueError(f"WarmStartConfig: steps={config.steps} must be >= 0, eval_every={config.eval_every} "
                         f"and batch_size={config.batch_size} >= 1")
    if config.target_accuracy is not None and not 0 < config.target_accuracy <= 1:
        raise ValueError(f"WarmStartConfig.target_accuracy={config.target_accuracy}: must be in (0, 1], or None")
