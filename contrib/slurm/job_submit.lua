--[[
job_submit.lua for gpuledger: set a new job's site factor from the priority feed.

gpuledger writes the feed (`gpuledger priority feed`, atomically: temp file + rename):
  {"generated_at": ..., "priority_weight": ..., ...,
   "associations": [{"account": "proj_a", "user": "alice", "fairshare": 0.5, "site_factor": 5000, ...}, ...]}
At submit time this script looks up the job's (account, user) association and sets job_desc.site_factor.
A job submitted without an explicit account (-A) is left alone: `gpuledger priority apply` sets its factor
on its next run. A missing or unreadable feed never blocks a submission: the script logs and accepts.

Slurm 22.05's Lua (5.1) has no JSON library, so a small JSON reader is included below. The parsed feed
is cached and re-read only when the file's size or its first bytes (which hold "generated_at") change.

Install: copy to the directory of slurm.conf as job_submit.lua, set JobSubmitPlugins=lua, and
`scontrol reconfigure`. See PRIORITY.md beside this file.
]]

-- Where `gpuledger priority feed --output` writes the feed.
local FEED_PATH = "/var/lib/gpuledger/priority-feed.json"

-- ------------------------------------------------------------------ a small JSON reader (RFC 8259 values)
local json_decode
do
  local escapes = { ['"'] = '"', ['\\'] = '\\', ['/'] = '/', b = '\b', f = '\f', n = '\n', r = '\r', t = '\t' }

  local function fail(s, i, what)
    local line = 1
    for _ in s:sub(1, i):gmatch("\n") do line = line + 1 end
    error(string.format("JSON: %s at byte %d (line %d)", what, i, line), 0)
  end

  local function skip(s, i)
    return s:find("[^ \t\r\n]", i) or (#s + 1)
  end

  local function utf8(cp)
    if cp < 0x80 then return string.char(cp) end
    if cp < 0x800 then return string.char(0xC0 + math.floor(cp / 0x40), 0x80 + cp % 0x40) end
    if cp < 0x10000 then
      return string.char(0xE0 + math.floor(cp / 0x1000), 0x80 + math.floor(cp / 0x40) % 0x40, 0x80 + cp % 0x40)
    end
    return string.char(0xF0 + math.floor(cp / 0x40000), 0x80 + math.floor(cp / 0x1000) % 0x40,
                       0x80 + math.floor(cp / 0x40) % 0x40, 0x80 + cp % 0x40)
  end

  local value

  local function str(s, i)  -- s:sub(i, i) == '"'
    local parts, j = {}, i + 1
    while true do
      local k = s:find('["\\]', j)
      if not k then fail(s, i, "unterminated string") end
      parts[#parts + 1] = s:sub(j, k - 1)
      if s:sub(k, k) == '"' then return table.concat(parts), k + 1 end
      local c = s:sub(k + 1, k + 1)
      if c == "u" then
        local hex = s:sub(k + 2, k + 5)
        if not hex:match("^%x%x%x%x$") then fail(s, k, "bad \\u escape") end
        local cp, nxt = tonumber(hex, 16), k + 6
        if cp >= 0xD800 and cp < 0xDC00 and s:sub(nxt, nxt + 1) == "\\u" then  -- surrogate pair
          local lo = tonumber(s:sub(nxt + 2, nxt + 5), 16)
          if lo and lo >= 0xDC00 and lo < 0xE000 then
            cp, nxt = 0x10000 + (cp - 0xD800) * 0x400 + (lo - 0xDC00), nxt + 6
          end
        end
        parts[#parts + 1] = utf8(cp)
        j = nxt
      elseif escapes[c] then
        parts[#parts + 1] = escapes[c]
        j = k + 2
      else
        fail(s, k, "bad escape")
      end
    end
  end

  local function num(s, i)
    local text = s:match("^-?%d+%.?%d*[eE]?[-+]?%d*", i)
    local n = text and tonumber(text)
    if not n then fail(s, i, "bad number") end
    return n, i + #text
  end

  local function arr(s, i)
    local out, n = {}, 0
    i = skip(s, i + 1)
    if s:sub(i, i) == "]" then return out, i + 1 end
    while true do
      local v
      v, i = value(s, i)
      n = n + 1
      out[n] = v
      i = skip(s, i)
      local c = s:sub(i, i)
      if c == "]" then return out, i + 1 end
      if c ~= "," then fail(s, i, "expected , or ]") end
      i = skip(s, i + 1)
    end
  end

  local function obj(s, i)
    local out = {}
    i = skip(s, i + 1)
    if s:sub(i, i) == "}" then return out, i + 1 end
    while true do
      if s:sub(i, i) ~= '"' then fail(s, i, "expected a key") end
      local k
      k, i = str(s, i)
      i = skip(s, i)
      if s:sub(i, i) ~= ":" then fail(s, i, "expected :") end
      local v
      v, i = value(s, skip(s, i + 1))
      out[k] = v
      i = skip(s, i)
      local c = s:sub(i, i)
      if c == "}" then return out, i + 1 end
      if c ~= "," then fail(s, i, "expected , or }") end
      i = skip(s, i + 1)
    end
  end

  value = function(s, i)
    local c = s:sub(i, i)
    if c == "{" then return obj(s, i) end
    if c == "[" then return arr(s, i) end
    if c == '"' then return str(s, i) end
    if c == "-" or c:match("%d") then return num(s, i) end
    if s:sub(i, i + 3) == "true" then return true, i + 4 end
    if s:sub(i, i + 4) == "false" then return false, i + 5 end
    if s:sub(i, i + 3) == "null" then return nil, i + 4 end
    fail(s, i, "unexpected character")
  end

  json_decode = function(s)
    local v, i = value(s, skip(s, 1))
    if skip(s, i) <= #s then fail(s, i, "trailing data") end
    return v
  end
end

-- ------------------------------------------------------------------ the feed, cached
local cache = { head = nil, size = nil, factors = nil }

-- Returns a table "account\0user" -> site factor, or nil and a message.
local function load_feed()
  local f, err = io.open(FEED_PATH, "r")
  if not f then return nil, err end
  local size = f:seek("end")
  f:seek("set", 0)
  local head = f:read(512) or ""
  if cache.factors and cache.size == size and cache.head == head then
    f:close()
    return cache.factors
  end
  local text = head .. (f:read("*a") or "")
  f:close()
  local ok, doc = pcall(json_decode, text)
  if not ok then return nil, FEED_PATH .. ": " .. tostring(doc) end
  if type(doc) ~= "table" or type(doc.associations) ~= "table" then
    return nil, FEED_PATH .. ": no associations list"
  end
  local factors = {}
  for _, a in ipairs(doc.associations) do
    if type(a) == "table" and type(a.account) == "string" and type(a.user) == "string"
       and type(a.site_factor) == "number" then
      factors[a.account .. "\0" .. a.user] = math.floor(a.site_factor + 0.5)
    end
  end
  cache.head, cache.size, cache.factors = head, size, factors
  return factors
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  local account, user = job_desc.account, job_desc.user_name
  if account == nil or account == "" or user == nil then
    return slurm.SUCCESS  -- default account: left to `gpuledger priority apply`
  end
  local factors, err = load_feed()
  if not factors then
    slurm.log_info("gpuledger: no site factor for %s@%s: %s", user, account, tostring(err))
    return slurm.SUCCESS
  end
  local v = factors[account .. "\0" .. user]
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
