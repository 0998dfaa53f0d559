"""Each engine step's plan: which requests run and how many prompt tokens each prefills
(`scheduler`), which model owns the decode lane (`lane`, a registry of policies), where a stop
string ends a stream (`stop_strings`), and how many compute threads the machine's load leaves
(`threads`)."""
