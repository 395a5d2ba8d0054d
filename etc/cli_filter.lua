--[[
slurm-mig cli_filter.lua: make `srun --gres=mig:3g` work outside an allocation.

Install as cli_filter.lua in the directory of slurm.conf, with
CliFilterPlugins=lua (see etc/slurm.conf.snippet). It runs in the user's
sbatch/srun/salloc before the request leaves the machine.

Why this exists: Slurm reads "mig:3g" as a count of 3 with a "g" size suffix.
job_submit.lua rewrites a *job's* request on slurmctld, but srun also sends
the same text as the *step's* request, which job_submit.lua never sees, so
`srun --gres=mig:3g cmd` got its job and then failed to create its step. This
filter rewrites every mig item of --gres to "mig:<type>:<count>" on the client,
for the job and the step alike. It only normalises what it understands and
never refuses anything: job_submit.lua stays the one place that checks
requests and explains refusals.
--]]

-- Kept equal to PROFILE_TO_GRES / MAX_PER_GPU in slurm_mig/slurm/gres.py by
-- tests/test_job_submit_table.py (the same tables as job_submit.lua).
local MAX_PER_GPU = {
    ["1g"] = 7,
    ["1gme"] = 1,
    ["1gdm"] = 4,
    ["2g"] = 3,
    ["2gme"] = 1,
    ["3g"] = 2,
    ["4g"] = 1,
    ["7g"] = 1,
}

local PROFILE_TO_TYPE = {
    ["1g.10gb"] = "1g",
    ["1g.10gb+me"] = "1gme",
    ["1g.12gb"] = "1g",
    ["1g.12gb+me"] = "1gme",
    ["1g.18gb"] = "1g",
    ["1g.18gb+me"] = "1gme",
    ["1g.20gb"] = "1gdm",
    ["1g.23gb"] = "1g",
    ["1g.23gb+me"] = "1gme",
    ["1g.24gb"] = "1gdm",
    ["1g.35gb"] = "1gdm",
    ["1g.36gb"] = "1gdm",
    ["1g.45gb"] = "1gdm",
    ["1g.47gb"] = "1gdm",
    ["1g.5gb"] = "1g",
    ["1g.5gb+me"] = "1gme",
    ["1g.6gb"] = "1g",
    ["1g.6gb+me"] = "1gme",
    ["2g.10gb"] = "2g",
    ["2g.12gb"] = "2g",
    ["2g.12gb+me"] = "2gme",
    ["2g.20gb"] = "2g",
    ["2g.24gb"] = "2g",
    ["2g.35gb"] = "2g",
    ["2g.36gb"] = "2g",
    ["2g.45gb"] = "2g",
    ["2g.47gb"] = "2g",
    ["3g.20gb"] = "3g",
    ["3g.40gb"] = "3g",
    ["3g.47gb"] = "3g",
    ["3g.48gb"] = "3g",
    ["3g.71gb"] = "3g",
    ["3g.72gb"] = "3g",
    ["3g.90gb"] = "3g",
    ["3g.93gb"] = "3g",
    ["4g.20gb"] = "4g",
    ["4g.24gb"] = "4g",
    ["4g.40gb"] = "4g",
    ["4g.47gb"] = "4g",
    ["4g.48gb"] = "4g",
    ["4g.71gb"] = "4g",
    ["4g.72gb"] = "4g",
    ["4g.90gb"] = "4g",
    ["4g.93gb"] = "4g",
    ["7g.141gb"] = "7g",
    ["7g.144gb"] = "7g",
    ["7g.180gb"] = "7g",
    ["7g.186gb"] = "7g",
    ["7g.40gb"] = "7g",
    ["7g.80gb"] = "7g",
    ["7g.94gb"] = "7g",
    ["7g.96gb"] = "7g",
}

local function resolve_type(name)
    local key = string.lower(name)
    if MAX_PER_GPU[key] then
        return key
    end
    return PROFILE_TO_TYPE[key]
end

-- "mig:3g" -> "mig:3g:1", "mig:3g.40gb:2" -> "mig:3g:2", "gres:mig:1g" -> "gres:mig:1g:1";
-- anything else comes back as it was.
local function rewrite_item(item)
    local prefix, body = string.match(item, "^(gres[:/])(.*)$")
    if prefix == nil then
        prefix, body = "", item
    end
    local name, size, colon, count = string.match(body, "^(%a+):([^:]+)(:?)(.*)$")
    if name == nil or string.lower(name) ~= "mig" then
        return item
    end
    if colon == ":" and count == "" then
        return item  -- "mig:3g:" names no count: job_submit.lua refuses it with its message
    end
    local gtype = resolve_type(size)
    if gtype == nil then
        return item
    end
    if count == "" then
        count = "1"
    elseif not string.match(count, "^%d+$") then
        return item
    end
    return prefix .. "mig:" .. gtype .. ":" .. count
end

local function rewrite_gres(value)
    local items = {}
    for item in string.gmatch(value, "[^,]+") do
        table.insert(items, rewrite_item(item))
    end
    return table.concat(items, ",")
end

function slurm_cli_setup_defaults(options, early_pass)
    return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, pack_offset)
    local value = options["gres"]
    if value ~= nil and value ~= "" and string.find(string.lower(value), "mig", 1, true) then
        local new = rewrite_gres(value)
        if new ~= value then
            options["gres"] = new
        end
    end
    return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, job_id, step_id)
    return slurm.SUCCESS
end
