"""`accelerate.commands`'s module paths (`from accel.commands.launch import launch_command_parser`), as thin
re-exports of the `accel` command line in accel/cli/."""
