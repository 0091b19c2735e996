"""What every registration and deletion of an owner's broker objects shares: the owner lock,
the owner's broker login, the broker objects a deletion leaves behind."""
