"""The torch-free ground floor: vocabulary every layer of lorafusion shares (imports nothing of ours)."""
