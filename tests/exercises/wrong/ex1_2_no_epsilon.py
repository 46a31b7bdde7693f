"""Exercise 1.2, wrong: divides by the std without + 1e-4: equal rewards give 0 / 0 = NaN."""

EXERCISE = "1.2"


def group_advantages(rewards, num_generations, scale_rewards="group"):
    grouped = rewards.view(-1, num_generations)
    advantages = grouped - grouped.mean(1, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(1, keepdim=True))
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std())
    return advantages.reshape(-1)
