--[[
job_submit.lua for gpuledger: set a new job's site factor from the flat priority feed.

gpuledger writes the flat feed beside its JSON feed (`gpuledger priority feed` / `priority watch`; atomically:
temp file + rename, so this script sees the old file or the new one, never half of one):

  # gpuledger-priority-feed v1 generated_at=1795969360.000 audit_entry=118 audit_leaf=6bb0...d2 entries=2
  proj_a alice 5000
  proj_b carol 10000

The header starts with the magic and ends with entries=N; what lies between (the generation time, the audit
log's fairshare entry the feed was computed from, for `gpuledger audit verify`) is not read here.

At submit time this script looks up the job's (account, user) and sets job_desc.site_factor. It reads the file
with plain string functions: no JSON parser runs inside slurmctld. The parsed table is cached and re-read only
when the header line changes (Slurm's Lua has no stat(); the header carries the feed's generation time and
entry count, and every write changes it), so a submission costs one open and one line read.

A job submitted without an explicit account (-A) is left alone: `gpuledger priority apply` sets its factor.
A missing, unreadable or malformed feed never rejects a submission: the script logs and leaves the factor
alone. A feed whose line count differs from its header's is malformed as a whole (no partial table).

Install: copy to the directory of slurm.conf as job_submit.lua, set JobSubmitPlugins=lua, and
`scontrol reconfigure`. See PRIORITY.md beside this file.
]]

-- Where `gpuledger priority feed --output /var/lib/gpuledger/priority-feed.json` writes the flat feed.
local FEED_PATH = "/var/lib/gpuledger/priority-feed.txt"
local MAGIC = "# gpuledger-priority-feed v1 "

-- The last parse: header line -> factors table (or the error, so a bad file is parsed once, not per job).
local cache = { header = nil, factors = nil, err = nil }

-- Parse the whole file; returns a table "account\0user" -> site factor, or nil and a message.
local function parse(f, header)
  if header:sub(1, #MAGIC) ~= MAGIC then
    return nil, "first line is not '" .. MAGIC .. "...'"
  end
  local want = tonumber(header:match(" entries=(%d+)%s*$"))
  if not want then return nil, "header has no entries=N" end
  local factors, n, lineno = {}, 0, 1
  for line in f:lines() do
    lineno = lineno + 1
    if line ~= "" then
      local account, user, value = line:match("^(%S+) (%S+) (-?%d+)$")
      if not account then
        return nil, string.format("line %d is not 'account user factor': %q", lineno, line:sub(1, 80))
      end
      factors[account .. "\0" .. user] = tonumber(value)
      n = n + 1
    end
  end
  if n ~= want then
    return nil, string.format("%d entries, header says %d (truncated?)", n, want)
  end
  return factors
end

-- Returns the factors table, or nil and a message.
local function load_feed()
  local f, err = io.open(FEED_PATH, "r")
  if not f then return nil, err end
  local header = f:read("*l")
  if header == nil then
    f:close()
    return nil, FEED_PATH .. ": empty"
  end
  if header ~= cache.header then
    local ok, factors, perr = pcall(parse, f, header)
    if not ok then factors, perr = nil, tostring(factors) end
    cache.header, cache.factors = header, factors
    cache.err = perr and (FEED_PATH .. ": " .. perr) or nil
    if perr then slurm.log_error("gpuledger: priority feed rejected: %s", cache.err) end
  end
  f:close()
  return cache.factors, cache.err
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  local account, user = job_desc.account, job_desc.user_name
  if account == nil or account == "" or user == nil then
    return slurm.SUCCESS  -- default account: left to `gpuledger priority apply`
  end
  local ok, factors, err = pcall(load_feed)
  if not ok then factors, err = nil, tostring(factors) end
  if not factors then
    slurm.log_info("gpuledger: no site factor for %s@%s: %s", user, account, tostring(err))
    return slurm.SUCCESS
  end
  -- Slurm lowercases the account only after job_submit has run (`-A PROJ_A` is proj_a's); the feed's are lower case
  local v = factors[string.lower(account) .. "\0" .. user]
  if v ~= nil then
    job_desc.site_factor = v
    slurm.log_debug("gpuledger: site factor %d for %s@%s", v, user, account)
  end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

slurm.log_info("gpuledger job_submit.lua loaded (feed %s)", FEED_PATH)
return slurm.SUCCESS
