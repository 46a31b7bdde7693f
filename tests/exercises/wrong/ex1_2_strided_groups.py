"""Exercise 1.2, wrong: groups rewards by stride (view(G, -1)) instead of G consecutive completions."""

EXERCISE = "1.2"


def group_advantages(rewards, num_generations, scale_rewards="group"):
    grouped = rewards.view(num_generations, -1)
    advantages = grouped - grouped.mean(0, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(0, keepdim=True) + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    return advantages.reshape(-1)
