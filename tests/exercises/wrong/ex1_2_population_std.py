"""Exercise 1.2, wrong: divides by the population std (n, not n - 1), unlike TRL."""

EXERCISE = "1.2"


def group_advantages(rewards, num_generations, scale_rewards="group"):
    grouped = rewards.view(-1, num_generations)
    advantages = grouped - grouped.mean(1, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(1, keepdim=True, unbiased=False) + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    return advantages.reshape(-1)
