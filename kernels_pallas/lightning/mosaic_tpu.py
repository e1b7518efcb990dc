def interpret_params():
    pass
