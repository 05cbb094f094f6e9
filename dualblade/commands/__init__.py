from dualblade.commands.run import load_run_config as load_run_config
