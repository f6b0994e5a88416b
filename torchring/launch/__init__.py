"""torchring-run: the command line (cli), the hosts it reaches over ssh (ssh) and the agent that
runs on each of them (node), the ranks' output (output) and their thread counts (threads).
It shares only the process core's settings, environment and build with the library."""
