local t = now(ARGV[1])
return fmt(t)
