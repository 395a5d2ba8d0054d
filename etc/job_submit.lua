--[[
slurm-mig job_submit.lua: normalise and check MIG GRES requests.

Install as job_submit.lua in the directory of slurm.conf, with
JobSubmitPlugins=lua (see etc/slurm.conf.snippet).

Why this exists: Slurm reads "--gres=mig:3g" as a count of 3 with a "g" size
suffix and rejects it, and a full profile name such as "mig:3g.40gb" is not a
type any node advertises ("Invalid Trackable RESource (TRES) specification").
The plugin sees the request before Slurm parses it (job_desc.tres_per_node
holds the raw "gres:mig:3g"), so it rewrites every mig item to
"gres:mig:<type>:<count>" and rejects what can never run, with a message the
user sees in sbatch/srun/salloc's output.

Accepted:  mig:<k>g  mig:<k>g:<count>  mig:<type>[:<count>] for the types below
           mig:<profile>[:<count>], e.g. mig:3g.40gb, mig:1g.20gb, mig:1g.10gb:2
Rejected:  unknown sizes (mig:5g, mig:8g, mig:0g), untyped mig / mig:<count>,
           counts that are 0, not plain integers or more than a node can hold,
           and two sizes in one job (mig:3g,mig:1g:2): one job, one size;
           more than one node (--nodes=2, --nodes=1-3, -n 2 --ntasks-per-node=1);
           mig beside a GRES whose Slurm plugin sets CUDA_VISIBLE_DEVICES
           itself (gpu, mps, shard: --gres=gpu:1,mig:1g, --gpus=1, ...; not
           a count of 0: --gres=gpu:0,mig:1g, --gpus=0 ask for no GPU).
A MIG job submitted without a maximum node count gets max_nodes = 1.
Other GRES items in the same request pass through untouched.
--]]

-- The largest number of MIG-capable GPUs on any node of this cluster. Admins
-- set this; the local test cluster substitutes its own value when it copies
-- the file (it rewrites this exact line).
local MAX_GPUS_PER_NODE = 8

-- Most instances of each type one GPU can hold. Kept equal to MAX_PER_GPU in
-- slurm_mig/slurm/gres.py by tests/test_job_submit_table.py.
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

-- Full NVIDIA profile names -> GRES type. Kept equal to PROFILE_TO_GRES in
-- slurm_mig/slurm/gres.py by tests/test_job_submit_table.py. "1g.10gb" is the
-- plain 1g of A100-80GB/H100-80GB (on A100-40GB it is the double-memory
-- profile: ask for mig:1gdm there).
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

local USAGE = "use --gres=mig:<size>[:<count>] with size 1g, 2g, 3g, 4g or 7g " ..
    "(also 1gdm, 1gme, 2gme) or a profile name such as mig:3g.40gb"

local function trim(s)
    return (s:gsub("^%s+", ""):gsub("%s+$", ""))
end

local function split(s, sep)
    local out = {}
    for piece in string.gmatch(s, "([^" .. sep .. "]+)") do
        table.insert(out, piece)
    end
    return out
end

-- Resolve a requested size ("3g", "3G", "1gdm", "3g.40gb", "1g.5gb+me") to a
-- type, or nil.
local function resolve_type(name)
    local key = string.lower(name)
    if MAX_PER_GPU[key] then
        return key
    end
    return PROFILE_TO_TYPE[key]
end

-- Rewrite one GRES request string (a tres_per_node value). Returns the new
-- string and nil, or nil and an error message. Strings without mig come back
-- unchanged (the same object), so non-mig jobs are left exactly as submitted.
local function rewrite_tres(tres)
    if tres == nil or tres == "" then
        return tres, nil
    end
    local items = {}
    local counts = {}
    local seen_mig = false
    for _, raw in ipairs(split(tres, ",")) do
        local item = trim(raw)
        -- 22.05 writes "gres:mig:3g", later releases "gres/mig:3g"; keep the
        -- caller's spelling when writing back.
        local prefix, body = string.match(item, "^(gres[:/])(.*)$")
        if prefix == nil then
            prefix, body = "", item
        end
        -- --gres=gres/mig:3g arrives as "gres:gres/mig:3g" (Slurm adds "gres:" to what was typed), and the
        -- controller (slurm_mig/slurm/gres.py parse_gres_item) reads it as mig:3g: check it as mig:3g too.
        if prefix == "gres:" and string.sub(body, 1, 5) == "gres/" then
            prefix, body = "gres:gres/", string.sub(body, 6)
        end
        local parts = split(body, ":")
        local name = parts[1] and string.lower(parts[1]) or ""
        if name ~= "mig" then
            table.insert(items, { text = item })
        else
            seen_mig = true
            local shown = "mig" .. string.sub(body, 4)
            -- A bare mig or mig:<number> would let Slurm pick any type: refuse.
            -- (Empty fields such as "mig:" never get here: sbatch/srun/salloc
            -- reject them client-side as "Invalid generic resource".)
            if #parts < 2 or string.match(parts[2], "^%d+$") or string.find(body, "::", 1, true)
                or string.sub(body, -1) == ":" then
                return nil, string.format("--gres=%s does not name a MIG size; %s", shown, USAGE)
            end
            if #parts > 3 then
                return nil, string.format("--gres=%s is malformed; %s", shown, USAGE)
            end
            if string.lower(parts[2]) == "pad" then
                -- mig:pad only keeps a node's mig total constant (slurm_mig/slurm/gres.py).
                return nil, string.format("--gres=%s: 'pad' is slurm-mig's padding, not a MIG size; %s", shown, USAGE)
            end
            local gtype = resolve_type(parts[2])
            if gtype == nil then
                return nil, string.format("unknown MIG size '%s' in --gres=%s; %s", parts[2], shown, USAGE)
            end
            local count = 1
            if parts[3] ~= nil then
                if not string.match(parts[3], "^%d+$") then
                    return nil, string.format(
                        "--gres=%s: the instance count '%s' must be a whole number >= 1", shown, parts[3])
                end
                -- More digits than any node's count: said as written (tonumber would overflow %d).
                if #string.gsub(parts[3], "^0+", "") > 6 then
                    return nil, string.format(
                        "--gres=%s: the instance count %s is more than a node can hold; use fewer or larger " ..
                        "instances", shown, parts[3])
                end
                count = tonumber(parts[3])
                if count < 1 then
                    return nil, string.format("--gres=%s: the instance count must be at least 1", shown)
                end
            end
            if counts[gtype] == nil then
                table.insert(items, { mig = gtype, prefix = prefix })
                counts[gtype] = 0
            end
            counts[gtype] = counts[gtype] + count
        end
    end
    if not seen_mig then
        return tres, nil
    end
    -- One size per job: the controller plans, binds and records a job as one size times a count, so a
    -- job with two sizes would get only one of them.
    local sizes = {}
    for _, it in ipairs(items) do
        if it.mig then
            table.insert(sizes, "mig:" .. it.mig)
        end
    end
    if #sizes > 1 then
        return nil, string.format(
            "a job asks for one MIG size (got %s); submit one job per size", table.concat(sizes, " and "))
    end
    -- One size, so the count alone bounds the compute slices: at most 7 per GPU.
    for gtype, n in pairs(counts) do
        local most = MAX_PER_GPU[gtype] * MAX_GPUS_PER_NODE
        if n > most then
            return nil, string.format(
                "%d mig:%s instances per node requested, but a node holds at most %d " ..
                "(%d per GPU x %d GPUs); use fewer or larger instances",
                n, gtype, most, MAX_PER_GPU[gtype], MAX_GPUS_PER_NODE)
        end
    end
    local out = {}
    for _, it in ipairs(items) do
        if it.mig then
            table.insert(out, string.format("%smig:%s:%d", it.prefix, it.mig, counts[it.mig]))
        else
            table.insert(out, it.text)
        end
    end
    return table.concat(out, ","), nil
end

-- Only tres_per_node carries --gres. The other tres_per_* fields come from
-- --gpus* / --tres-per-task options, which slurm-mig does not support for mig.
local OTHER_TRES_FIELDS = { "tres_per_job", "tres_per_socket", "tres_per_task" }

-- Slurm's "not set" for a 32-bit field (NO_VAL). A job record keeps 0 for "no maximum node count".
local NO_VAL = 4294967294

local function node_count(v)
    local n = tonumber(v)
    if n == nil or n == NO_VAL or n == 0 then
        return nil
    end
    return n
end

-- Each item of a tres_per_* value: its text without the "gres:" (or "gres/") prefix, and its ":" parts.
local function tres_items(tres)
    local items = {}
    if tres ~= nil then
        for _, raw in ipairs(split(tres, ",")) do
            local body = string.gsub(string.gsub(trim(raw), "^gres[:/]", ""), "^gres/", "")
            table.insert(items, { body = body, parts = split(body, ":") })
        end
    end
    return items
end

-- Does a (rewritten or stored) tres_per_node value ask for mig? Item by item, so that another
-- GRES whose name merely contains "mig" (gres:amig:1) is not taken for one.
local function asks_mig(tres)
    for _, item in ipairs(tres_items(tres)) do
        if string.lower(item.parts[1] or "") == "mig" then
            return true
        end
    end
    return false
end

-- The MIG size (type) a rewritten or stored tres_per_node value asks for, or nil: one per job.
local function mig_size(tres)
    for _, item in ipairs(tres_items(tres)) do
        local parts = item.parts
        if string.lower(parts[1] or "") == "mig" and parts[2] ~= nil then
            return resolve_type(parts[2]) or string.lower(parts[2])
        end
    end
    return nil
end

-- GRES whose own Slurm plugins set CUDA_VISIBLE_DEVICES in the job (gres/gpu, gres/mps, gres/shard). The
-- TaskProlog sets it to the job's MIG instances, so a job holding one of these beside mig would not see
-- the GPU Slurm gave it; the two cannot be merged either (Slurm's value is a device index, and a CUDA
-- process enumerates one MIG device at most).
local CUDA_GRES = { gpu = true, mps = true, shard = true }

-- The option a user wrote for each tres_per_* field that can carry gpu (--gpus-per-node goes to
-- tres_per_node, as --gres does).
local TRES_OPTION = { tres_per_node = "--gres", tres_per_job = "--gpus", tres_per_socket = "--gpus-per-socket",
    tres_per_task = "--gpus-per-task" }

-- The first item of a tres_per_* value naming a CUDA_GRES, without its "gres:" prefix, or nil. An item
-- whose count is 0 (--gres=gpu:0, --gpus=0, --gpus-per-node=0, --gpus-per-task=0: Slurm 22.05 keeps each as
-- "gres:gpu:0", measured on the local cluster) allocates nothing, so hides nothing: a site's wrapper or
-- form that says "no whole GPU" that way beside --gres=mig:1g is not refused.
local function cuda_gres_item(tres)
    for _, item in ipairs(tres_items(tres)) do
        local parts = item.parts
        if CUDA_GRES[string.lower(parts[1] or "")] and not (#parts >= 2 and string.match(parts[#parts], "^0+$")) then
            return item.body
        end
    end
    return nil
end

-- job_rec is nil at submission. On an update (scontrol update JobId=N ...) job_desc holds only the
-- fields being changed, so what is not changed is read from the job's record: a Gres update on a job
-- that asked for --nodes=2, or a NumNodes or NumTasks update on a MIG job, must meet the same rules as a
-- submission. An update that touches none of GRES, TRES, node or task counts is not checked (an admin
-- changing a job queued before this script was installed must not be refused for what the job asked
-- then). The record has no task counts in 22.05 (num_tasks, ntasks_per_node read nil): a NumTasks update
-- is kept on one node by the job's max_nodes, and Slurm holds it (BadConstraints) if its tasks cannot fit.
local function check_desc(job_desc, job_rec)
    for _, field in ipairs(OTHER_TRES_FIELDS) do
        local v = job_desc[field]
        if v ~= nil and string.find(string.lower(v), "mig", 1, true) then
            return string.format("MIG instances must be requested per node with --gres (got %s=%s); %s",
                field, v, USAGE)
        end
    end
    local new, err = rewrite_tres(job_desc.tres_per_node)
    if err ~= nil then
        return err
    end
    -- Slurm 22.05 keeps a queued job's old GRES type beside the one an update names (measured on the local
    -- cluster: a mig:1g job updated to Gres=mig:2g showed TresPerNode=gres:mig:2g:1 but was allocated
    -- JOB_GRES=mig:1g:1,mig:2g:1; updated to mig:3g, or Gres= cleared, it waited for ever, "node n1 lacks
    -- GRES", beside an idle 3g). The controller reads only the new size, so no node is carved for both.
    -- A new count of the same size replaces the old (mig:2g to mig:2g:2 ran on two 2g).
    if job_rec ~= nil and job_desc.tres_per_node ~= nil then
        local was, now = mig_size(job_rec.tres_per_node), mig_size(new)
        if was ~= nil and now ~= was then
            return string.format("a queued job's MIG size cannot be changed (mig:%s to %s): Slurm would keep " ..
                "its mig:%s beside the new request and the job would wait for a node with both; cancel it and " ..
                "submit it again (its instance count can be changed: Gres=mig:%s:<count>)", was,
                now and ("mig:" .. now) or "no MIG instance", was, was)
        end
    end
    local nodes = node_count(job_desc.min_nodes)
    local most = node_count(job_desc.max_nodes)
    local tres = new
    if job_rec ~= nil then
        local tasks = tonumber(job_desc.num_tasks)
        local touched = new ~= nil or nodes ~= nil or most ~= nil or (tasks ~= nil and tasks < NO_VAL)
        for _, field in ipairs(OTHER_TRES_FIELDS) do
            touched = touched or job_desc[field] ~= nil
        end
        if not touched then
            return nil
        end
        if tres == nil then
            tres = job_rec.tres_per_node
        end
        if nodes == nil then
            nodes = node_count(job_rec.min_nodes)
        end
        if most == nil then
            most = node_count(job_rec.max_nodes)
        end
    end
    -- A MIG job's instances are bound on one node (the controller keeps one binding per job).
    if asks_mig(tres) then
        -- Nor can it hold a GPU that Slurm's own gpu (mps, shard) plugin hands out: see CUDA_GRES.
        for _, field in ipairs({ "tres_per_node", "tres_per_job", "tres_per_socket", "tres_per_task" }) do
            local v = job_desc[field]
            if field == "tres_per_node" then
                v = tres
            elseif v == nil and job_rec ~= nil then
                v = job_rec[field]
            end
            local item = cuda_gres_item(v)
            if item ~= nil then
                return string.format("a job asks for MIG instances or for Slurm's %s GRES, not both (got mig " ..
                    "and %s from %s): slurm-mig sets CUDA_VISIBLE_DEVICES to the job's MIG instances, which " ..
                    "would hide what Slurm allocated for %s; submit one job for each, or ask for a whole GPU " ..
                    "as a MIG instance (--gres=mig:7g; mig:4g on an A30)", string.lower(split(item, ":")[1]),
                    item, TRES_OPTION[field], item)
            end
        end
        local asked = nil
        if nodes ~= nil and nodes > 1 then
            asked = string.format("%d nodes were requested", nodes)
        elseif most ~= nil and most > 1 then
            -- --nodes=1-3: Slurm gives a job as many nodes of its range as it can (sbatch(1)).
            asked = string.format("up to %d nodes were requested (--nodes=%d-%d)", most, nodes or 1, most)
        else
            -- --ntasks=2 --ntasks-per-node=1 needs two nodes whatever --nodes says.
            local tasks, per_node = tonumber(job_desc.num_tasks), tonumber(job_desc.ntasks_per_node)
            if tasks ~= nil and per_node ~= nil and tasks < NO_VAL and per_node >= 1 and per_node < 65534
                and tasks > per_node then
                asked = string.format("%d tasks at most %d per node need %d nodes", tasks, per_node,
                    math.ceil(tasks / per_node))
            end
        end
        if asked ~= nil then
            return string.format("MIG jobs run on one node, but %s; use --nodes=1 " ..
                "(and several instances with mig:<size>:<count>)", asked)
        end
        -- Without a maximum Slurm spreads a job over as many nodes as its tasks' CPUs need (-n 128 on 64-CPU
        -- nodes: two, each with its own instances) or --spread-job asks, and only one node's are bound. Pinned
        -- to one, a job whose tasks fit no node is accepted and then held by Slurm (Reason=BadConstraints,
        -- measured on 22.05). An update pins too: a job submitted without mig has no maximum, and
        -- "scontrol update JobId=N Gres=mig:1g" on an -n 2 --ntasks-per-node=1 (or -n 12 on 8-CPU nodes)
        -- job ran it on two nodes; pinned by an unprivileged user's update, it was accepted (measured on 22.05).
        -- A MIG job submitted through this script already has max_nodes 1 (its record's), so nothing changes.
        if most == nil then
            job_desc.max_nodes = 1
        end
    end
    if new ~= job_desc.tres_per_node then
        job_desc.tres_per_node = new
    end
    return nil
end

function slurm_job_submit(job_desc, part_list, submit_uid)
    local err = check_desc(job_desc)
    if err ~= nil then
        slurm.log_user("slurm-mig: %s", err)
        slurm.log_info("slurm-mig: rejected job from uid %s: %s", tostring(submit_uid), err)
        return slurm.ERROR
    end
    return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    -- scontrol update job ... Gres=mig:3g goes through the same rules. Slurm
    -- 22.05 does not show log_user text for a refused update: scontrol only
    -- prints "Unspecified error for job N"; the reason is in slurmctld's log.
    local err = check_desc(job_desc, job_rec or {})
    if err ~= nil then
        slurm.log_user("slurm-mig: %s", err)
        slurm.log_info("slurm-mig: refused update of job %s by uid %s: %s",
            tostring(job_rec and job_rec.job_id), tostring(modify_uid), err)
        return slurm.ERROR
    end
    return slurm.SUCCESS
end

slurm.log_info("slurm-mig job_submit.lua loaded (MAX_GPUS_PER_NODE=%d)", MAX_GPUS_PER_NODE)

return slurm.SUCCESS
