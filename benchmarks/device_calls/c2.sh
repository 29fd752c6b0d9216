# Call 2: carry .gw/part2. Only stashes the bundle's part 2 (its 58 MiB fill the call).
mkdir -p /tmp/stash && cp -r .gw/part2 /tmp/stash/ && echo part2 stashed && ls /tmp/stash
